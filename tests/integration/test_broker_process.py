"""The broker as a process over loopback: ``chronomq start`` (send, pull, long polling, offsets), clean
restart and SIGKILL under SYNC_FLUSH losing no acknowledged message, separate ``chronomq namesrv`` +
``chronomq broker`` processes registering (several brokers, master + slave), configuration errors, and
``chronomq admin``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from chronomq.message import decode_records
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode as R
from chronomq.remoting.codes import ResponseCode as C
from tests.compat.harness import ChronomqProcess
from tests.conftest import free_port, wait_for
from tests.integration.rawclient import RawClient, heartbeat_body, pull_ext

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chronomq.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
        cwd=REPO,
    )


@pytest.fixture
def server(tmp_path: Path):
    p = ChronomqProcess(tmp_path / "data")
    p.start()
    yield p
    p.stop()


def _pull_everything(b: RawClient, topic: str, queues: int, group: str = "G") -> list:
    out = []
    for q in range(queues):
        offset = 0
        while True:
            resp = b.pull(group, topic, q, offset)
            if resp.code != C.SUCCESS:
                break
            msgs = decode_records(resp.body)
            out.extend(msgs)
            offset = int(resp.ext_fields["nextBeginOffset"])
    return out


def test_start_serves_route_send_pull_offsets_and_long_polling(server: ChronomqProcess) -> None:
    with RawClient(server.namesrv_addr) as ns, RawClient(server.broker_addr) as b:
        assert ns.request(R.GET_ROUTEINFO_BY_TOPIC, {"topic": "PT"}).code == C.TOPIC_NOT_EXIST
        route = json.loads(ns.request(R.GET_ROUTEINFO_BY_TOPIC, {"topic": "TBW102"}).body)
        assert route["brokerDatas"][0]["brokerAddrs"] == {"0": server.broker_addr}
        resp = b.send_message("PT", b"m0", 0, {"TAGS": "a", "KEYS": "k0"})
        assert resp.code == C.SUCCESS and resp.ext_fields["queueOffset"] == "0"
        assert ns.request(R.GET_ROUTEINFO_BY_TOPIC, {"topic": "PT"}).code == C.SUCCESS
        wait_for(
            lambda: b.request(R.GET_MAX_OFFSET, {"topic": "PT", "queueId": 0}).ext_fields["offset"] == "1"
        )
        (m,) = decode_records(b.pull("G", "PT", 0, 0).body)
        assert m.body == b"m0" and f"{m.store_host[0]}:{m.store_host[1]}" == server.broker_addr
        # long polling: a held pull is answered as soon as a message lands ...
        with RawClient(server.broker_addr) as p:
            t0 = time.monotonic()
            opaque = p.send(
                RemotingCommand.request(R.PULL_MESSAGE, pull_ext("G", "PT", 0, 1, suspend_ms=20_000))
            )
            with pytest.raises(TimeoutError):
                p.recv(opaque, timeout=0.3)  # held
            b.send_message("PT", b"m1", 0)
            resp = p.recv(opaque, timeout=10)
            assert resp.code == C.SUCCESS and decode_records(resp.body)[0].body == b"m1"
            assert time.monotonic() - t0 < 15
            # ... and at its timeout when nothing comes
            t0 = time.monotonic()
            resp = p.pull("G", "PT", 0, 2, suspend_ms=700, timeout=10)
            elapsed = time.monotonic() - t0
            assert resp.code == C.PULL_NOT_FOUND and 0.6 <= elapsed < 5
        # heartbeat + offsets
        assert b.request(R.HEART_BEAT, body=heartbeat_body("cid-1", "G", ["PT"])).code == C.SUCCESS
        ids = json.loads(b.request(R.GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": "G"}).body)
        assert ids == {"consumerIdList": ["cid-1"]}
        q = {"consumerGroup": "G", "topic": "PT", "queueId": 0}
        assert b.request(R.UPDATE_CONSUMER_OFFSET, {**q, "commitOffset": "2"}).code == C.SUCCESS
        assert b.request(R.QUERY_CONSUMER_OFFSET, q).ext_fields == {"offset": "2"}
        b.request(R.UPDATE_CONSUMER_OFFSET, {**q, "queueId": 1, "commitOffset": "0"})
        b.send_message("PT", b"m-q1", 1)
        wait_for(
            lambda: b.request(R.GET_MAX_OFFSET, {"topic": "PT", "queueId": 1}).ext_fields["offset"] == "1"
        )
        out = _cli("admin", "consumer-progress", "-n", server.namesrv_addr, "-g", "G")
        rows = [line.split() for line in out.stdout.splitlines()[1:]]
        # the last consumed time: queue 0's second message (ISO-8601 UTC); queue 1 has nothing committed
        assert out.returncode == 0 and [r[:6] + r[7:] for r in rows] == [
            ["broker-a", "PT", "0", "2", "2", "0", "1"],
            ["broker-a", "PT", "1", "1", "0", "1", "1"],
        ], out.stdout
        iso = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
        assert re.fullmatch(iso, rows[0][6]) and rows[1][6] == "-", out.stdout


def test_clean_restart_keeps_messages_offsets_and_topics(server: ChronomqProcess) -> None:
    with RawClient(server.broker_addr) as b:
        for i in range(40):
            assert b.send_message("CR", f"m{i}".encode(), i % 4, {"KEYS": f"key{i}"}).code == C.SUCCESS
        b.request(
            R.UPDATE_CONSUMER_OFFSET, {"consumerGroup": "G", "topic": "CR", "queueId": 1, "commitOffset": "7"}
        )
    assert server.stop() == 0  # SIGTERM: clean shutdown, exit 0
    data = server.data_dir
    assert not (data / "abort").exists()
    assert json.loads((data / "config" / "consumerOffset.json").read_text())["offsetTable"]["CR@G"] == {
        "1": 7
    }
    server.start()
    with RawClient(server.broker_addr) as b, RawClient(server.namesrv_addr) as ns:
        assert ns.request(R.GET_ROUTEINFO_BY_TOPIC, {"topic": "CR"}).code == C.SUCCESS  # topic config kept
        got = _pull_everything(b, "CR", 4)
        assert sorted(m.body for m in got) == sorted(f"m{i}".encode() for i in range(40))
        q = {"consumerGroup": "G", "topic": "CR", "queueId": 1}
        assert b.request(R.QUERY_CONSUMER_OFFSET, q).ext_fields == {"offset": "7"}


def test_sigkill_under_sync_flush_loses_no_acknowledged_message(tmp_path: Path) -> None:
    p = ChronomqProcess(tmp_path / "data", {"flushDiskType": "SYNC_FLUSH"})
    p.start()
    acked: list[bytes] = []
    stop = threading.Event()

    def producer(n: int) -> None:
        try:
            with RawClient(p.broker_addr, timeout=5) as b:
                for i in range(5000):
                    if stop.is_set():
                        return
                    body = f"p{n}-{i}".encode()
                    resp = b.send_message("SK", body, i % 4)
                    if resp.code == C.SUCCESS:
                        acked.append(body)
        except (OSError, TimeoutError, ConnectionError):
            return  # the broker died under us: sends without an answer were never acknowledged

    threads = [threading.Thread(target=producer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: len(acked) >= 300, timeout=60, message="300 acknowledged sends")
    os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
    p.stop(kill=True)
    stop.set()
    for t in threads:
        t.join(30)
    n_acked = len(acked)
    p.start()
    with RawClient(p.broker_addr) as b:
        got = {m.body for m in _pull_everything(b, "SK", 4)}
    missing = [a for a in acked[:n_acked] if a not in got]
    assert not missing, f"{len(missing)} of {n_acked} acknowledged messages lost, e.g. {missing[:5]}"
    p.stop()


def test_separate_namesrv_and_brokers_register(tmp_path: Path) -> None:
    ns_port = free_port()
    ns_addr = f"127.0.0.1:{ns_port}"
    procs: list[subprocess.Popen[str]] = []

    def spawn(*args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "chronomq.cli.main", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=_env(),
            cwd=REPO,
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "ready" in line, line
        return proc

    def broker(data: str, port: int, *sets: str) -> subprocess.Popen[str]:
        # every port a broker opens is one free_port chose: the defaults (HA at the broker's port + 1,
        # /metrics at + 2, the 5.x endpoint at 8081) were never reserved, and another test's process may
        # hold them
        extra = [f"haListenPort={free_port()}", "metricsPort=-1", "grpcListenPort=-1", *sets]
        return spawn("broker", "-n", ns_addr, "--data-dir", str(tmp_path / data), "--broker-port", str(port),
                     *(arg for kv in extra for arg in ("--set", kv)))

    try:
        spawn("namesrv", "--port", str(ns_port), "--metrics-port", "-1")
        ports = [free_port() for _ in range(3)]
        broker("a", ports[0], "brokerName=broker-a")
        broker("a1", ports[1], "brokerName=broker-a", "brokerId=1", "brokerRole=SLAVE")
        b_proc = broker("b", ports[2], "brokerName=broker-b")
        with RawClient(ns_addr) as ns:
            route = json.loads(ns.request(R.GET_ROUTEINFO_BY_TOPIC, {"topic": "TBW102"}).body)
            addrs = {bd["brokerName"]: bd["brokerAddrs"] for bd in route["brokerDatas"]}
            assert addrs == {
                "broker-a": {"0": f"127.0.0.1:{ports[0]}", "1": f"127.0.0.1:{ports[1]}"},
                "broker-b": {"0": f"127.0.0.1:{ports[2]}"},
            }
            # a topic created on broker-b by a send is routable at once (registration on topic creation)
            with RawClient(f"127.0.0.1:{ports[2]}") as b:
                assert b.send_message("OnlyB", b"x", 0).code == C.SUCCESS
            route = wait_for(
                lambda: ns.request(R.GET_ROUTEINFO_BY_TOPIC, {"topic": "OnlyB"}).code == C.SUCCESS,
                message="OnlyB routable",
            )
            out = _cli("admin", "cluster", "-n", ns_addr)
            assert out.returncode == 0 and "broker-b" in out.stdout and str(ports[1]) in out.stdout
            assert "ASYNC_MASTER" in out.stdout and "SLAVE" in out.stdout  # each broker's role
            out = _cli("admin", "delay-stats", "-n", ns_addr)
            assert out.returncode == 0 and "broker-a" in out.stdout and "pending" in out.stdout
            assert out.stdout.count("\n    1 ") >= 2  # a level-1 row for each master
            # broker-b stops cleanly: it unregisters and leaves the route
            b_proc.send_signal(signal.SIGTERM)
            assert b_proc.wait(30) == 0
            wait_for(
                lambda: ns.request(R.GET_ROUTEINFO_BY_TOPIC, {"topic": "OnlyB"}).code == C.TOPIC_NOT_EXIST,
                message="broker-b gone",
            )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_configuration_errors_are_refused_and_unknown_keys_warned(tmp_path: Path) -> None:
    out = _cli("start", "--data-dir", str(tmp_path), "--set", "flushDiskType=SOMETIMES")
    assert out.returncode == 2 and "flushDiskType" in out.stderr and "Traceback" not in out.stderr
    out = _cli("start", "--data-dir", str(tmp_path), "--set", "listenPort=abc")
    assert out.returncode == 2 and "listenPort" in out.stderr
    out = _cli("start", "-c", str(tmp_path / "missing.conf"))
    assert out.returncode == 2 and "missing.conf" in out.stderr
    conf = tmp_path / "broker.conf"
    conf.write_text("brokerName=broker-z\nnoSuchKey=1\nmessageDelayLevel=1s 2s\n")
    p = ChronomqProcess(tmp_path / "data")
    p.overrides = {"grpcListenPort": "-1"}  # not RocketMQ's 8081: a port this test did not reserve
    cmd = [*p.command(), "-c", str(conf)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("chronomq ready")
        with RawClient(p.namesrv_addr) as ns:
            info = json.loads(ns.request(R.GET_BROKER_CLUSTER_INFO).body)
            assert "broker-z" in info["brokerAddrTable"]
        with RawClient(p.broker_addr) as b:
            stats = json.loads(b.request(R.CHRONOMQ_DELAY_STATS).body)
            assert [lv["delay_ms"] for lv in stats["levels"]] == [1000, 2000]
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "noSuchKey" in err


def test_batch_tags_view_query_and_send_back_through_the_process(tmp_path: Path) -> None:
    from chronomq.remoting.codec import BatchItem, encode_batch_body
    from tests.integration.rawclient import send_ext

    p = ChronomqProcess(tmp_path / "data", {"messageDelayLevel": "100ms 200ms 300ms"})
    p.start()
    try:
        with RawClient(p.broker_addr) as b:
            items = [
                BatchItem(f"b{i}".encode(), {"UNIQ_KEY": f"U{i}", "KEYS": f"key{i}", "TAGS": "ab"[i % 2]})
                for i in range(6)
            ]
            resp = b.request(R.SEND_MESSAGE, send_ext("IB", 2, batch=True), encode_batch_body(items))
            assert resp.code == C.SUCCESS and len(resp.ext_fields["msgId"].split(",")) == 6
            wait_for(
                lambda: b.request(R.GET_MAX_OFFSET, {"topic": "IB", "queueId": 2}).ext_fields["offset"] == "6"
            )
            resp = b.pull("G", "IB", 2, 0, subscription="b")
            assert [m.body for m in decode_records(resp.body)] == [b"b1", b"b3", b"b5"]
            assert resp.ext_fields["nextBeginOffset"] == "6"
            first_id = b.request(R.SEND_MESSAGE, send_ext("IB", 2, batch=True), encode_batch_body(items[:1]))
            view = b.request(R.VIEW_MESSAGE_BY_ID, {"msgId": first_id.ext_fields["msgId"]})
            assert view.code == C.SUCCESS and decode_records(view.body)[0].body == b"b0"
            query = {
                "topic": "IB",
                "key": "key3",
                "maxNum": 8,
                "beginTimestamp": "0",
                "endTimestamp": str(2**62),
            }
            got = wait_for(lambda: b.request(R.QUERY_MESSAGE, query).body, message="index")
            assert [m.body for m in decode_records(got)] == [b"b3"]  # type: ignore[arg-type]
            # send-back: with levels scaled down, the copy reaches %RETRY%G through the real delay path
            (m0,) = decode_records(b.pull("G", "IB", 2, 0, max_msgs=1).body)
            resp = b.request(
                R.CONSUMER_SEND_MSG_BACK, {"group": "G", "offset": str(m0.commit_log_offset), "delayLevel": 0}
            )
            assert resp.code == C.SUCCESS
            wait_for(lambda: b.pull("G", "%RETRY%G", 0, 0).code == C.SUCCESS, message="retry copy delivered")
            (r,) = decode_records(b.pull("G", "%RETRY%G", 0, 0).body)
            assert r.body == b"b0" and r.reconsume_times == 1 and r.properties["RETRY_TOPIC"] == "IB"
    finally:
        p.stop()
