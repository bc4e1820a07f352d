"""The timer store through the broker process: ``chronomq start`` over loopback on the real clock,
a raw-codec client for SEND (10 / 310 / 320 batch) and PULL, and the ``chronomq admin cancel | reschedule |
pending | delay-stats`` verbs for the request codes 9001-9004.

Lateness is measured as (first time a poll saw the message) - deliverMs and (store timestamp) -
deliverMs; the bound asserted is functional (a few seconds), figures are printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chronomq.message import MessageExt, decode_records
from chronomq.remoting.codec import BatchItem, encode_batch_body
from chronomq.remoting.codes import SEND_V2_FIELDS
from chronomq.remoting.codes import RequestCode as R
from chronomq.remoting.codes import ResponseCode as C
from tests.compat.harness import ChronomqProcess
from tests.conftest import free_port, wait_for
from tests.integration.rawclient import RawClient, send_ext

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
LATE_BOUND_MS = 3000  # functional bound on the loaded test box, not a benchmark


def _cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "chronomq.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChronomqProcess]:
    p = ChronomqProcess(tmp_path_factory.mktemp("timer") / "data", {"timerMaxDelaySec": "3600"})
    p.start()
    yield p
    p.stop()


def _now() -> int:
    return int(time.time() * 1000)


def _queue(b: RawClient, topic: str, qid: int) -> list[MessageExt]:
    out: list[MessageExt] = []
    offset = 0
    for _ in range(100):  # bounded
        r = b.pull("G_timer", topic, qid, offset)
        if r.code != C.SUCCESS:
            break
        out.extend(decode_records(r.body))
        offset = int(r.ext_fields["nextBeginOffset"])
    return out


def _send(b: RawClient, topic: str, body: bytes, props: dict[str, str], qid: int = 0) -> dict[str, str]:
    r = b.send_message(topic, body, qid, props)
    assert r.code == C.SUCCESS, r.remark
    return {k: str(v) for k, v in r.ext_fields.items()}


def _watch(b: RawClient, topic: str, qid: int, want: int,
           timeout: float) -> dict[bytes, tuple[int, MessageExt]]:
    """Poll the queue until ``want`` messages are there; body -> (first time seen, message)."""
    seen: dict[bytes, tuple[int, MessageExt]] = {}

    def poll() -> bool:
        msgs = _queue(b, topic, qid)
        now = _now()  # after the pull answered: seeing it with now < due would prove it early
        for m in msgs:
            seen.setdefault(m.body, (now, m))
        return len(seen) >= want

    wait_for(poll, timeout=timeout, interval=0.02, message=f"{want} messages on {topic}/{qid}")
    return seen


def test_every_timer_property_arrives_on_its_topic_not_before_its_time(server: ChronomqProcess) -> None:
    topic = "TimerProps"
    with RawClient(server.broker_addr) as b:
        t0 = _now()
        sends = {
            b"deliver-ms": {"TIMER_DELIVER_MS": str(t0 + 1500)},
            b"delay-sec": {"TIMER_DELAY_SEC": "1"},
            b"delay-ms": {"TIMER_DELAY_MS": "1200"},
            b"start-deliver": {"__STARTDELIVERTIME": str(t0 + 1800)},
            b"timer-beats-delay": {"TIMER_DELAY_MS": "1000", "DELAY": "4"},  # level 4 = 30 s
        }
        due: dict[bytes, int] = {}
        for body, props in sends.items():
            ext = _send(b, topic, body, {**props, "KEYS": body.decode()})
            due[body] = int(ext["deliverMs"])
            assert ext["queueOffset"] == "0" and ext["uniqKey"] and len(ext["msgId"]) == 32
        # V2 header (310) too
        v2 = {short: send_ext(topic, 0, {"TIMER_DELAY_MS": "1300"})[long]
              for short, long in SEND_V2_FIELDS.items() if long in send_ext(topic, 0)}
        r = b.request(R.SEND_MESSAGE_V2, v2, b"v2")
        assert r.code == C.SUCCESS, r.remark
        due[b"v2"] = int(r.ext_fields["deliverMs"])
        assert due[b"deliver-ms"] == t0 + 1500 and due[b"start-deliver"] == t0 + 1800
        assert all(t0 + 900 <= d <= _now() + 1800 for d in due.values()), due
        assert _queue(b, topic, 0) == [] or min(due.values()) <= _now()
        seen = _watch(b, topic, 0, len(due), timeout=30)
    late = {}
    for body, (first_seen, m) in seen.items():
        assert m.topic == topic and m.queue_id == 0
        assert m.store_timestamp >= due[body], f"{body!r} stored {due[body] - m.store_timestamp} ms early"
        assert first_seen >= due[body]
        assert int(m.properties["TIMER_DELIVER_MS"]) == due[body]
        assert "DELAY" not in m.properties
        late[body.decode()] = (m.store_timestamp - due[body], first_seen - due[body])
        assert late[body.decode()][1] < LATE_BOUND_MS, late
    print("lateness ms (stored - due, first seen - due):", late)


def test_cancel_before_due_never_arrives(server: ChronomqProcess) -> None:
    topic = "TimerCancel"
    with RawClient(server.broker_addr) as b:
        # long enough for two CLI processes to start on a loaded box (about 1 s each)
        doomed = _send(b, topic, b"doomed", {"TIMER_DELAY_MS": "5000", "KEYS": "doomed-key"})
        by_key = _send(b, topic, b"doomed-by-key", {"TIMER_DELAY_MS": "5000", "KEYS": "kill-me"})
        barrier = _send(b, topic, b"barrier", {"TIMER_DELAY_MS": "5500"})
        out = _cli("admin", "cancel", "-n", server.namesrv_addr, doomed["uniqKey"])
        assert out.returncode == 0, out.stderr
        assert "CANCELLED" in out.stdout and doomed["uniqKey"] in out.stdout
        out = _cli("admin", "cancel", "-n", server.namesrv_addr, "kill-me", "--key", "--json")
        assert out.returncode == 0, out.stderr
        res = json.loads(out.stdout)
        assert [(x["outcome"], x["msg_id"]) for x in res] == [("CANCELLED", by_key["uniqKey"])]
        # the barrier is due after both: once it is there, they would have been delivered before it
        seen = _watch(b, topic, 0, 1, timeout=30)
        assert list(seen) == [b"barrier"] and _now() >= int(barrier["deliverMs"])
        assert [m.body for m in _queue(b, topic, 0)] == [b"barrier"]
        out = _cli("admin", "cancel", "-n", server.namesrv_addr, doomed["uniqKey"])
        assert out.returncode == 3 and "ALREADY_CANCELLED" in out.stdout
        out = _cli("admin", "cancel", "-n", server.namesrv_addr, barrier["msgId"])  # offset msg id works too
        assert out.returncode == 3 and "ALREADY_DELIVERED" in out.stdout
        out = _cli("admin", "cancel", "-n", server.namesrv_addr, "no-such-id")
        assert out.returncode == 3 and "UNKNOWN" in out.stdout


def test_reschedule_moves_it_and_pending_lists_it(server: ChronomqProcess) -> None:
    topic = "TimerMove"
    with RawClient(server.broker_addr) as b:
        far = _send(b, topic, b"far", {"TIMER_DELAY_SEC": "600", "KEYS": "move-me", "TAGS": "TagM"})
        _send(b, topic, b"other", {"TIMER_DELAY_SEC": "900", "KEYS": "stay"})
        out = _cli("admin", "pending", "-n", server.namesrv_addr, "--topic", topic, "--json")
        assert out.returncode == 0, out.stderr
        items = json.loads(out.stdout)["items"]
        assert [i["msg_id"] for i in items] == [far["uniqKey"], items[1]["msg_id"]]
        assert items[0]["deliver_ms"] == int(far["deliverMs"]) and items[0]["tags"] == "TagM"
        out = _cli("admin", "pending", "-n", server.namesrv_addr, "--key", "move-me")
        assert out.returncode == 0 and far["uniqKey"] in out.stdout and "TagM" in out.stdout
        out = _cli("admin", "pending", "-n", server.namesrv_addr, "--topic", topic, "--count")
        assert out.returncode == 0 and "total: 2" in out.stdout
        out = _cli("admin", "reschedule", "-n", server.namesrv_addr, "move-me", "--key", "--in", "1",
                   "--json")
        assert out.returncode == 0, out.stderr
        res = json.loads(out.stdout)
        assert [x["outcome"] for x in res] == ["RESCHEDULED"]
        new_due = res[0]["deliver_ms"]
        seen = _watch(b, topic, 0, 1, timeout=30)
        first_seen, m = seen[b"far"]
        assert m.store_timestamp >= new_due and first_seen >= new_due
        assert first_seen - new_due < LATE_BOUND_MS
        print("rescheduled lateness ms:", m.store_timestamp - new_due, first_seen - new_due)
        out = _cli("admin", "pending", "-n", server.namesrv_addr, "--topic", topic, "--json")
        assert [i["body_size"] for i in json.loads(out.stdout)["items"]] == [5]  # "other" is still waiting
        out = _cli("admin", "reschedule", "-n", server.namesrv_addr, "stay", "--key",
                   "--at", "2000-01-01T00:00:00Z")  # a past time: due now
        assert out.returncode == 0 and "RESCHEDULED" in out.stdout
        _watch(b, topic, 0, 2, timeout=30)


def test_refused_and_bad_values(server: ChronomqProcess) -> None:
    with RawClient(server.broker_addr) as b:
        r = b.send_message("TimerBad", b"x", 0, {"TIMER_DELAY_SEC": "3601"})
        assert r.code == C.MESSAGE_ILLEGAL and "timerMaxDelaySec" in (r.remark or ""), r.remark
        r = b.send_message("TimerBad", b"x", 0, {"TIMER_DELIVER_MS": str(_now() + 2 * 3600_000)})
        assert r.code == C.MESSAGE_ILLEGAL and "maximum delay" in (r.remark or ""), r.remark
        for bad in ("tomorrow", "-3", "inf", ""):
            r = b.send_message("TimerBad", b"x", 0, {"TIMER_DELIVER_MS": bad})
            assert r.code == C.MESSAGE_ILLEGAL and "TIMER_DELIVER_MS" in (r.remark or ""), (bad, r.remark)
        items = [BatchItem(body=b"a", properties={"TIMER_DELAY_MS": "900000"}),
                 BatchItem(body=b"b", properties={"TIMER_DELAY_MS": "99999999"})]  # beyond the maximum
        r = b.request(R.SEND_BATCH_MESSAGE, send_ext("TimerBad", 0, batch=True), encode_batch_body(items))
        assert r.code == C.MESSAGE_ILLEGAL, r.remark
        r = b.request(R.CHRONOMQ_RESCHEDULE, {"id": "x", "deliverMs": "soon"})
        assert r.code == C.SYSTEM_ERROR and "deliverMs" in (r.remark or "")
        assert _queue(b, "TimerBad", 0) == []
    out = _cli("admin", "pending", "-n", server.namesrv_addr, "--topic", "TimerBad", "--count")
    assert out.returncode == 0 and "total: 0" in out.stdout  # nothing half-scheduled
    out = _cli("admin", "reschedule", "-n", server.namesrv_addr, "x", "--at", "next tuesday")
    assert out.returncode == 1 and "ISO-8601" in out.stderr
    out = _cli("admin", "reschedule", "-n", server.namesrv_addr, "x", "--in", "99999")
    assert out.returncode == 1 and "maximum delay" in out.stderr


def test_timed_batch_and_delay_stats(server: ChronomqProcess) -> None:
    topic = "TimerBatch"
    with RawClient(server.broker_addr) as b:
        items = [BatchItem(body=f"b{i}".encode(), properties={"TIMER_DELAY_MS": str(800 + 100 * i)})
                 for i in range(4)]
        r = b.request(R.SEND_BATCH_MESSAGE, send_ext(topic, 1, batch=True), encode_batch_body(items))
        assert r.code == C.SUCCESS, r.remark
        due = [int(x) for x in r.ext_fields["deliverMs"].split(",")]
        assert len(due) == 4 and len(r.ext_fields["uniqKey"].split(",")) == 4
        seen = _watch(b, topic, 1, 4, timeout=30)
        for i in range(4):
            first, m = seen[f"b{i}".encode()]
            assert m.store_timestamp >= due[i] and first >= due[i]
    out = _cli("admin", "delay-stats", "-n", server.namesrv_addr)
    assert out.returncode == 0, out.stderr
    assert "timer: pending=" in out.stdout and "TimerBatch" in out.stdout
    out = _cli("admin", "delay-stats", "-n", server.namesrv_addr, "--json")
    timer = json.loads(out.stdout.splitlines()[0])["stats"]["timer"]
    assert timer["delivered"] >= 4 and timer["early_deliveries"] == 0


def test_clean_restart_keeps_pending_messages(tmp_path: Path) -> None:
    p = ChronomqProcess(tmp_path / "data")
    p.start()
    try:
        with RawClient(p.broker_addr) as b:
            kept = _send(b, "TimerRestart", b"kept", {"TIMER_DELAY_SEC": "120", "KEYS": "survivor"})
            gone = _send(b, "TimerRestart", b"gone", {"TIMER_DELAY_SEC": "120"})
            assert b.request(R.CHRONOMQ_CANCEL_SCHEDULED, {"id": gone["uniqKey"]}).code == C.SUCCESS
        assert p.stop() == 0
        p.start()
        out = _cli("admin", "pending", "-n", p.namesrv_addr, "--topic", "TimerRestart", "--json")
        items = json.loads(out.stdout)["items"]
        assert [(i["msg_id"], i["deliver_ms"]) for i in items] == [(kept["uniqKey"], int(kept["deliverMs"]))]
        out = _cli("admin", "reschedule", "-n", p.namesrv_addr, kept["uniqKey"], "--in", "0.5")
        assert out.returncode == 0, out.stderr
        with RawClient(p.broker_addr) as b:
            seen = _watch(b, "TimerRestart", 0, 1, timeout=30)
            assert list(seen) == [b"kept"]
    finally:
        p.stop()


def test_bad_timer_settings_are_configuration_errors(tmp_path: Path) -> None:
    for setting, word in (("timerPrecisionMs=7", "timerPrecisionMs"),
                          ("timerMaxDelaySec=abc", "timerMaxDelaySec")):
        out = _cli("start", "--data-dir", str(tmp_path / "d"), "--namesrv-port", str(free_port()),
                   "--broker-port", str(free_port()), "--set", setting)
        assert out.returncode == 2, out.stderr
        assert "configuration error" in out.stderr and word in out.stderr and "Traceback" not in out.stderr
        assert "unknown configuration key" not in out.stderr  # the timer's keys are known
