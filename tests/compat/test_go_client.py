"""The official RocketMQ Go client (github.com/apache/rocketmq-client-go/v2) against chronomq.

Each scenario is a function ``scenario_*(namesrv_addr, tmp_path) -> dict`` that only drives the client
(the driver in ``tests/compat/drivers/go``, see ``tests/compat/golang.py``) and returns what it saw; the
tests assert on those observations. The same functions can run against the reference Apache RocketMQ
broker for a differential comparison: values that legitimately differ between brokers (message ids,
commit-log offsets, queue choice, timestamps, latencies) are kept under the key ``"broker_specific"``;
everything else should compare equal. The broker runs with ``BROKER_CONFIG``: levels 1 and 2 keep
RocketMQ's 1 s and 5 s, the levels the retry ladder uses (3 and up) are 1 s instead of 10 s, 30 s, ...
(whole seconds: Apache RocketMQ's messageDelayLevel parser knows s, m, h and d, not ms). The scenarios
that depend on the table take it as ``delay_levels``, for a broker started with another one.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from chronomq.client import Admin
from tests.compat.golang import go_driver
from tests.compat.harness import ChronomqProcess, DriverProcess, run_driver, start_driver
from tests.conftest import async_wait_for, wait_for

pytestmark = [pytest.mark.compat, pytest.mark.timeout(240)]

DELAY_LEVELS = " ".join(["1s", "5s"] + ["1s"] * 16)
BROKER_CONFIG = {"messageDelayLevel": DELAY_LEVELS}
_UNIT_MS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
# set by the Go client itself on receipt (consumer.go processPullResult, push_consumer.go
# resetRetryAndNamespace), not stored by the broker
CLIENT_ADDED = frozenset({"CONSUME_START_TIME", "MAX_OFFSET", "MIN_OFFSET"})
# Apache RocketMQ's own property names (MessageConst, 4.9 and 5.x): a broker may add these
ROCKETMQ_PROPERTIES = frozenset({
    "KEYS", "TAGS", "WAIT", "DELAY", "RETRY_TOPIC", "REAL_TOPIC", "REAL_QID", "TRAN_MSG", "PGROUP",
    "MIN_OFFSET", "MAX_OFFSET", "BUYER_ID", "ORIGIN_MESSAGE_ID", "TRANSFER_FLAG", "CORRECTION_FLAG",
    "MQ2_FLAG", "RECONSUME_TIME", "MSG_REGION", "TRACE_ON", "UNIQ_KEY", "EXTEND_UNIQ_INFO",
    "MAX_RECONSUME_TIMES", "CONSUME_START_TIME", "INNER_NUM", "INNER_BASE", "DUP_INFO",
    "CHECK_IMMUNITY_TIME_IN_SECONDS", "TRAN_PREPARED_QUEUE_OFFSET", "__transactionId__",
    "TRANSACTION_CHECK_TIMES", "INSTANCE_ID", "CORRELATION_ID", "REPLY_TO_CLIENT", "TTL", "ARRIVE_TIME",
    "PUSH_REPLY_TIME", "CLUSTER", "MSG_TYPE", "POP_CK", "POP_CK_OFFSET", "1ST_POP_TIME", "__SHARDINGKEY",
    "PROPERTY_FORWARD_QUEUE_ID", "REDIRECT", "INNER_MULTI_DISPATCH", "INNER_MULTI_QUEUE_OFFSET",
    "TRACE_CONTEXT", "TIMER_DELAY_SEC", "TIMER_DELIVER_MS", "__BORNHOST", "BORN_TIMESTAMP",
    "TIMER_ENQUEUE_MS", "TIMER_DEQUEUE_MS", "TIMER_ROLL_TIMES", "TIMER_OUT_MS", "TIMER_DEL_UNIQKEY",
    "TIMER_DELAY_LEVEL", "__STARTDELIVERTIME", "TIMER_DELAY_MS",
})
MSG_ID = re.compile(r"^[0-9A-Fa-f]{32}$")
COMPRESSED_FLAG = 0x1  # sysFlag bit: the Go producer compresses bodies over 4 KiB (zlib)


@pytest.fixture
def go_client() -> Path:
    """The driver binary (the test is skipped, with the reason, without go or the module proxy)."""
    return go_driver()


# --- helpers ----------------------------------------------------------------------------------------------
def level_ms(delay_levels: str) -> list[int]:
    """'1s 5s 10s ...' -> [1000, 5000, 10000, ...] (RocketMQ's units: s, m, h, d)."""
    return [int(item[:-1]) * _UNIT_MS[item[-1]] for item in delay_levels.split()]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _body(spec: dict[str, Any]) -> bytes:
    return base64.b64decode(spec["body_b64"]) if "body_b64" in spec else str(spec["body"]).encode()


def _keys(spec: dict[str, Any]) -> str:
    keys = spec.get("keys") or []
    return " ".join([keys] if isinstance(keys, str) else keys)


def _produce(namesrv: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return run_driver("go:produce", {"namesrv": namesrv, "messages": messages}, timeout=90)


def _consumer(namesrv: str, tmp_path: Path, group: str, topic: str, **extra: Any) -> DriverProcess:
    args = {"namesrv": namesrv, "group": group, "topic": topic, "out": str(tmp_path / f"{group}.jsonl"),
            "max_seconds": 120, **extra}
    return start_driver("go:push_consume", args, tmp_path)


@contextlib.contextmanager
def _running(d: DriverProcess) -> Iterator[DriverProcess]:
    """Yield the driver; kill it on the way out if it still runs (a test that failed midway)."""
    try:
        yield d
    finally:
        if d.alive():
            d.kill()


def _consume_expected(namesrv: str, tmp_path: Path, group: str, topic: str, n: int,
                      **extra: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A push consumer run until it consumed ``n`` messages (it then stops by itself): its result and
    every delivery."""
    with _running(_consumer(namesrv, tmp_path, group, topic, expect=n, **extra)) as d:
        summary = d.wait(timeout=90)
    return summary, _deliveries(d)


def _deliveries(d: DriverProcess) -> list[dict[str, Any]]:
    return [r for r in d.records() if "event" not in r]


def _await(d: DriverProcess, pred: Callable[[list[dict[str, Any]]], bool], timeout: float, what: str) -> None:
    def check() -> bool:
        if pred(_deliveries(d)):
            return True
        if not d.alive():
            pytest.fail(f"the Go consumer exited while waiting for {what}; stderr:\n{d.stderr()}")
        return False

    wait_for(check, timeout=timeout, interval=0.05, message=what)


def _register_group(namesrv: str, group: str) -> None:
    """Create ``%RETRY%<group>`` (one queue, read and write: what a broker makes for a group's first
    consumer) on every master, and wait until the name server routes it, before the test's consumer
    starts. The Go client learns the retry topic's route only from a route refresh; its consumer's own
    start refreshes before its first heartbeat (which is when a broker would create the topic), so on a
    fresh group the first retries would otherwise wait for the 30 s route poll and the 20 s rebalance
    (internal/client.go, consumer/push_consumer.go Start).

    A consumer of the group started and stopped before the test's (the way this was done before) can
    stay registered on Apache RocketMQ 4.9: a heartbeat it sent as it stopped, handled after its
    connection's close, registers it again until the broker's 120 s channel expiry, and the test's
    consumer then gets only half of the topic's queues and none of the retry queue."""
    retry = f"%RETRY%{group}"

    async def create() -> None:
        async with Admin(namesrv) as a:
            await a.create_topic(retry, 1)

            async def routed() -> bool:
                return bool((await a.route_data(retry)).get("queueDatas"))

            await async_wait_for(routed, timeout=30, interval=0.05,
                                 message=f"the name server's route of {retry}")

    asyncio.run(create())


def _unknown_properties(record: dict[str, Any], user: dict[str, str]) -> set[str]:
    return set(record["properties"]) - ROCKETMQ_PROPERTIES - CLIENT_ADDED - set(user)


def _user_props_intact(record: dict[str, Any], spec: dict[str, Any]) -> bool:
    props = record["properties"]
    return all(props.get(k) == v for k, v in (spec.get("props") or {}).items())


def _intact(record: dict[str, Any], spec: dict[str, Any]) -> dict[str, bool]:
    return {"body": base64.b64decode(record["body_b64"]) == _body(spec),
            "tags": record["tags"] == spec.get("tags", ""),
            "keys": record["keys"] == _keys(spec),
            "user_properties": _user_props_intact(record, spec)}


# --- scenarios --------------------------------------------------------------------------------------------
def scenario_send(namesrv_addr: str, tmp_path: Path) -> dict[str, Any]:
    """Sync sends with tags, keys (one and several), user properties (non-ASCII too), a binary body and
    a 10 KB one (compressed by the client); then one push consumer reads them back."""
    topic, group = "GoSendTopic", "CG_go_send"
    specs: list[dict[str, Any]] = [
        {"topic": topic, "body": "plain text body", "tags": "TagA", "keys": ["order-1", "user-7"],
         "props": {"color": "red", "city": "Zürich 東京"}},
        {"topic": topic, "body_b64": _b64(bytes(range(256))), "tags": "TagB", "keys": "single-key",
         "props": {"kind": "binary"}},
        {"topic": topic, "body": ("chronomq go client " * 600)[:10_000], "tags": "TagA", "keys": "big",
         "props": {"size": "10000"}},
        {"topic": topic, "body": "bare"},
    ]
    sent = _produce(namesrv_addr, specs)
    results = sent["results"]
    obs: dict[str, Any] = {
        "acked": sent["acked"],
        "send": [{"status": r.get("status"), "error": r.get("error"),
                  "msg_id_is_32_hex": bool(MSG_ID.match(r.get("msg_id", ""))),
                  "offset_msg_id_is_32_hex": bool(MSG_ID.match(r.get("offset_msg_id", "")))}
                 for r in results],
    }
    # queue offsets of a fresh topic: 0, 1, 2, ... within each queue
    per_queue: dict[int, list[int]] = {}
    for r in results:
        if "queue_id" in r:
            per_queue.setdefault(r["queue_id"], []).append(r["queue_offset"])
    obs["queue_offsets_consecutive_from_0"] = all(v == list(range(len(v))) for v in per_queue.values())
    summary, got = _consume_expected(namesrv_addr, tmp_path, group, topic, len(specs))
    by_id: dict[str, list[dict[str, Any]]] = {}
    for rec in got:
        by_id.setdefault(rec["msg_id"], []).append(rec)
    obs["consumer_reason"] = summary["reason"]
    obs["messages"] = []
    for spec, r in zip(specs, results, strict=True):
        recs = by_id.get(r.get("msg_id", ""), [])
        rec = recs[0] if recs else None
        m: dict[str, Any] = {"deliveries": len(recs)}
        if rec is not None:
            m.update({
                "intact": _intact(rec, spec),
                "topic": rec["topic"], "queue_topic": rec["queue_topic"],
                "reconsume_times": rec["reconsume_times"],
                "compressed": bool(rec["sys_flag"] & COMPRESSED_FLAG),
                "same_queue_and_offset_as_send": (rec["queue_id"], rec["queue_offset"])
                == (r.get("queue_id"), r.get("queue_offset")),
                "offset_msg_id_as_send": rec["offset_msg_id"] == r.get("offset_msg_id"),
                "store_not_before_born": rec["store_timestamp"] >= rec["born_timestamp"],
                "has_uniq_key": rec["properties"].get("UNIQ_KEY") == r.get("msg_id"),
                "unknown_properties": sorted(_unknown_properties(rec, spec.get("props") or {})),
            })
        obs["messages"].append(m)
    obs["broker_specific"] = {
        "msg_ids": [r.get("msg_id") for r in results],
        "offset_msg_ids": [r.get("offset_msg_id") for r in results],
        "queues": [(r.get("queue_id"), r.get("queue_offset")) for r in results],
        "system_properties": [sorted(set(recs[0]["properties"]) - set(s.get("props") or {}) - CLIENT_ADDED)
                              for s, r in zip(specs, results, strict=True)
                              if (recs := by_id.get(r.get("msg_id", "")))],
    }
    return obs


def scenario_push_consume(namesrv_addr: str, tmp_path: Path) -> dict[str, Any]:
    """Two push consumer groups on one topic, one for every tag and one for "TagA || TagC"; half of
    the messages are sent before they start, half while they run."""
    topic = "GoPushTopic"
    tags = ("TagA", "TagB", "TagC")

    def spec(i: int) -> dict[str, Any]:
        return {"topic": topic, "body": f"push-{i}", "tags": tags[i % 3], "keys": f"k{i}",
                "props": {"seq": str(i)}}

    specs = [spec(i) for i in range(24)]
    wanted = {"CG_go_all": "*", "CG_go_tagged": "TagA || TagC"}
    expected = {"CG_go_all": list(specs),
                "CG_go_tagged": [s for s in specs if s["tags"] in ("TagA", "TagC")]}
    first = _produce(namesrv_addr, specs[:12])
    summaries: dict[str, dict[str, Any]] = {}

    def distinct_keys(recs: list[dict[str, Any]]) -> set[str]:
        return {r["keys"] for r in recs}

    with contextlib.ExitStack() as running:
        consumers = {g: running.enter_context(_running(_consumer(namesrv_addr, tmp_path, g, topic,
                                                                 expression=e)))
                     for g, e in wanted.items()}
        for g, d in consumers.items():
            before = {s["keys"] for s in expected[g] if int(s["keys"][1:]) < 12}
            _await(d, lambda recs, want=before: want <= distinct_keys(recs), 60, f"{g}: the first half")
        second = _produce(namesrv_addr, specs[12:])
        for g, d in consumers.items():
            every = {s["keys"] for s in expected[g]}
            _await(d, lambda recs, want=every: want <= distinct_keys(recs), 60, f"{g}: every message")
        for g, d in consumers.items():
            summaries[g] = d.stop()
    obs: dict[str, Any] = {"acked": first["acked"] + second["acked"]}
    for g, d in consumers.items():
        recs = _deliveries(d)
        by_key = {s["keys"]: s for s in specs}
        keys = [r["keys"] for r in recs]
        obs[g] = {
            "distinct": len(set(keys)),
            "duplicates": len(keys) - len(set(keys)),
            "missing": sorted({s["keys"] for s in expected[g]} - set(keys)),
            "unexpected": sorted(set(keys) - {s["keys"] for s in expected[g]}),
            "tags": sorted({r["tags"] for r in recs}),
            "all_intact": all(all(_intact(r, by_key[r["keys"]]).values())
                              for r in recs if r["keys"] in by_key),
            "reconsume_times": sorted({r["reconsume_times"] for r in recs}),
            "topics": sorted({r["topic"] for r in recs}),
            "unknown_properties": sorted(set().union(*(_unknown_properties(r, {"seq": ""}) for r in recs))),
            "consumed": summaries[g]["consumed"],
        }
    return obs


def scenario_delay(namesrv_addr: str, tmp_path: Path, delay_levels: str = DELAY_LEVELS,
                   used: tuple[int, int] = (1, 2)) -> dict[str, Any]:
    """Messages at two delay levels (``used``, the shorter first: 1 s and 5 s by default), and one without
    a level, to a running consumer; ``order_by_delay``: the undelayed one received first, then the
    shorter level's, then the longer's."""
    levels = level_ms(delay_levels)
    topic, group = "GoDelayTopic", "CG_go_delay"
    warm = _produce(namesrv_addr, [{"topic": topic, "body": "warm-up", "keys": "warm"}])
    specs = [{"topic": topic, "body": f"L{lv}-{i}", "keys": f"L{lv}-{i}", "tags": "Delayed",
              "delay_level": lv, "props": {"level": str(lv)}} for lv in used for i in range(2)]
    specs.append({"topic": topic, "body": "L0-0", "keys": "L0-0", "tags": "Now", "props": {"level": "0"}})
    with _running(_consumer(namesrv_addr, tmp_path, group, topic)) as d:
        _await(d, lambda recs: any(r["keys"] == "warm" for r in recs), 60, "the warm-up message")
        sent = _produce(namesrv_addr, specs)
        _await(d, lambda recs: {s["keys"] for s in specs} <= {r["keys"] for r in recs}, 40,
               "every delayed message")
        summary = d.stop()
    recs = [r for r in _deliveries(d) if r["keys"] != "warm"]
    obs: dict[str, Any] = {"acked": warm["acked"] + sent["acked"], "consumed": summary["consumed"],
                           "messages": {}, "broker_specific": {"late_ms": {}}}
    receipt: dict[str, int] = {}
    for spec, res in zip(specs, sent["results"], strict=True):
        key, level = spec["keys"], spec.get("delay_level", 0)
        mine = [r for r in recs if r["keys"] == key]
        m: dict[str, Any] = {"level": level, "deliveries": len(mine)}
        if mine:
            r = mine[0]
            due = r["born_timestamp"] + (levels[level - 1] if level else 0)
            receipt[key] = r["receipt_ms"]
            props = r["properties"]
            m.update({
                "not_early": r["receipt_ms"] >= due and r["store_timestamp"] >= due,
                "within_3s_of_due": r["receipt_ms"] - due < 3000,
                "intact": _intact(r, spec),
                "topic": r["topic"], "queue_topic": r["queue_topic"],
                "same_queue_as_send": r["queue_id"] == res.get("queue_id"),
                "msg_id_as_send": r["msg_id"] == res.get("msg_id"),
                "offset_msg_id_as_send": r["offset_msg_id"] == res.get("offset_msg_id"),
                "reconsume_times": r["reconsume_times"],
                "DELAY": props.get("DELAY"), "REAL_TOPIC": props.get("REAL_TOPIC"),
                "REAL_QID_is_send_queue": props.get("REAL_QID") == str(res.get("queue_id")),
                "unknown_properties": sorted(_unknown_properties(r, spec["props"])),
            })
            obs["broker_specific"]["late_ms"][key] = r["receipt_ms"] - due
        obs["messages"][key] = m
    short, long_ = used
    lv = {n: [receipt[s["keys"]] for s in specs if s.get("delay_level", 0) == n and s["keys"] in receipt]
          for n in (0, short, long_)}
    obs["order_by_delay"] = bool(all(lv.values()) and max(lv[0]) < min(lv[short])
                                 and max(lv[short]) < min(lv[long_]))
    return obs


def scenario_retry(namesrv_addr: str, tmp_path: Path, delay_levels: str = DELAY_LEVELS) -> dict[str, Any]:
    """A push consumer answers ConsumeRetryLater to the first two deliveries of each message: the broker
    sends it back through %RETRY%group at levels 3 and 4 (level 3 + reconsume times; 1 s each in
    BROKER_CONFIG), the third delivery is consumed."""
    ladder_ms = level_ms(delay_levels)[2:4]
    topic, group = "GoRetryTopic", "CG_go_retry"
    specs = [{"topic": topic, "body": f"retry-{i}", "tags": "TagR", "keys": f"r{i}",
              "props": {"owner": "go-compat", "n": str(i)}} for i in range(2)]
    _register_group(namesrv_addr, group)
    sent = _produce(namesrv_addr, specs)
    summary, recs = _consume_expected(namesrv_addr, tmp_path, group, topic, len(specs), retry_later_times=2)
    retry_topic = f"%RETRY%{group}"
    obs: dict[str, Any] = {"acked": sent["acked"], "consumed": summary["consumed"],
                           "failed": summary["failed"], "reason": summary["reason"], "messages": {},
                           "broker_specific": {"gaps_ms": {}}}
    for spec, res in zip(specs, sent["results"], strict=True):
        mine = sorted((r for r in recs if r["msg_id"] == res.get("msg_id")), key=lambda r: r["receipt_ms"])
        first = mine[0] if mine else None
        gaps = [b["receipt_ms"] - a["receipt_ms"] for a, b in itertools.pairwise(mine)]
        obs["messages"][spec["keys"]] = {
            # (reconsume times, the queue's topic as "topic" or "%RETRY%group", consumed)
            "ladder": [(r["reconsume_times"], "%RETRY%group" if r["queue_topic"] == retry_topic
                        else "topic" if r["queue_topic"] == topic else r["queue_topic"], r["consumed"])
                       for r in mine],
            "user_topic": sorted({r["topic"] for r in mine}),
            "all_intact": all(all(_intact(r, spec).values()) for r in mine),
            "retry_topic_property": sorted({r["properties"].get("RETRY_TOPIC", "") for r in mine[1:]}),
            "origin_message_id_is_first_offset_msg_id": first is not None and all(
                r["properties"].get("ORIGIN_MESSAGE_ID") == first["offset_msg_id"] for r in mine[1:]),
            # a send-back is due its level's time after the failed delivery returned
            "gaps_at_least_level": len(gaps) == 2
            and all(g >= lv for g, lv in zip(gaps, ladder_ms, strict=True)),
            "gaps_within_3s_of_level": all(g - lv < 3000 for g, lv in zip(gaps, ladder_ms, strict=False)),
            "unknown_properties": sorted(set().union(*(_unknown_properties(r, spec["props"]) for r in mine))),
        }
        obs["broker_specific"]["gaps_ms"][spec["keys"]] = gaps
    return obs


# --- the tests against chronomq ---------------------------------------------------------------------------
@pytest.fixture
def server(go_client: Path, chronomq_factory: Callable[..., ChronomqProcess]) -> ChronomqProcess:
    return chronomq_factory(dict(BROKER_CONFIG))


def test_send_tags_keys_properties(server: ChronomqProcess, tmp_path: Path) -> None:
    obs = scenario_send(server.namesrv_addr, tmp_path)
    assert obs["acked"] == 4, obs
    assert all(s == {"status": "SEND_OK", "error": None, "msg_id_is_32_hex": True,
                     "offset_msg_id_is_32_hex": True} for s in obs["send"]), obs["send"]
    assert obs["queue_offsets_consecutive_from_0"], obs["broker_specific"]["queues"]
    assert obs["consumer_reason"] == "expect"
    for i, m in enumerate(obs["messages"]):
        assert m["deliveries"] == 1, (i, m)
        assert m["intact"] == {"body": True, "tags": True, "keys": True, "user_properties": True}, (i, m)
        assert (m["topic"], m["queue_topic"], m["reconsume_times"]) == ("GoSendTopic", "GoSendTopic", 0), m
        assert m["same_queue_and_offset_as_send"] and m["offset_msg_id_as_send"], (i, m)
        assert m["store_not_before_born"] and m["has_uniq_key"], (i, m)
        assert m["compressed"] == (i == 2), (i, m)  # only the 10 KB body is over the client's 4 KiB
        assert m["unknown_properties"] == [], (i, m)


def test_push_consume_every_message_intact(server: ChronomqProcess, tmp_path: Path) -> None:
    obs = scenario_push_consume(server.namesrv_addr, tmp_path)
    assert obs["acked"] == 24
    for group, n, tags in (("CG_go_all", 24, ["TagA", "TagB", "TagC"]),
                           ("CG_go_tagged", 16, ["TagA", "TagC"])):
        g = obs[group]
        assert (g["distinct"], g["missing"], g["unexpected"], g["duplicates"]) == (n, [], [], 0), (group, g)
        assert g["tags"] == tags and g["all_intact"], (group, g)
        assert g["reconsume_times"] == [0] and g["topics"] == ["GoPushTopic"], (group, g)
        assert g["consumed"] == n and g["unknown_properties"] == [], (group, g)


def test_delay_levels_1s_5s(server: ChronomqProcess, tmp_path: Path) -> None:
    obs = scenario_delay(server.namesrv_addr, tmp_path)
    assert obs["acked"] == 6
    for key, m in obs["messages"].items():
        late = obs["broker_specific"]["late_ms"].get(key)
        assert m["deliveries"] == 1, (key, m)
        assert m["not_early"], (key, m, late)
        assert m["within_3s_of_due"], (key, m, late)  # a functional bound, not a benchmark
        assert all(m["intact"].values()), (key, m)
        assert (m["topic"], m["queue_topic"], m["reconsume_times"]) == ("GoDelayTopic", "GoDelayTopic", 0)
        assert m["same_queue_as_send"] and m["msg_id_as_send"], (key, m)
        if m["level"]:
            # the due message is a new record, put back on its real topic and queue; like RocketMQ 4.x
            # (ScheduleMessageService.messageTimeup writes the properties string before it clears
            # DELAY) it still carries its level, and REAL_TOPIC / REAL_QID
            assert not m["offset_msg_id_as_send"], (key, m)
            assert m["REAL_TOPIC"] == "GoDelayTopic" and m["REAL_QID_is_send_queue"], (key, m)
            assert m["DELAY"] == str(m["level"]), (key, m)
        else:
            assert m["offset_msg_id_as_send"], (key, m)
            assert (m["REAL_TOPIC"], m["DELAY"]) == (None, None), (key, m)
    assert obs["order_by_delay"], obs
    print("lateness after the due time, ms:", obs["broker_specific"]["late_ms"])


def test_retry_later_twice_then_consumed(server: ChronomqProcess, tmp_path: Path) -> None:
    obs = scenario_retry(server.namesrv_addr, tmp_path)
    assert (obs["acked"], obs["consumed"], obs["failed"], obs["reason"]) == (2, 2, 4, "expect"), obs
    for key, m in obs["messages"].items():
        assert m["ladder"] == [(0, "topic", False), (1, "%RETRY%group", False), (2, "%RETRY%group", True)], \
            (key, m)
        assert m["user_topic"] == ["GoRetryTopic"] and m["all_intact"], (key, m)
        assert m["retry_topic_property"] == ["GoRetryTopic"], (key, m)
        assert m["origin_message_id_is_first_offset_msg_id"], (key, m)
        assert m["gaps_at_least_level"] and m["gaps_within_3s_of_level"], (key, m, obs["broker_specific"])
    print("gaps between deliveries, ms:", obs["broker_specific"]["gaps_ms"])


def test_no_broker_internal_property_reaches_the_client(server: ChronomqProcess, tmp_path: Path) -> None:
    obs = scenario_retry(server.namesrv_addr, tmp_path)
    if obs["consumed"] != 2:  # not the expected failure: a real one
        pytest.fail(f"the retry scenario did not complete: {obs}")
    assert {k: m["unknown_properties"] for k, m in obs["messages"].items()} == {"r0": [], "r1": []}
